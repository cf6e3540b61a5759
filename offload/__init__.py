"""Where a model's parts live and how fast they move: the hardware probe (the first part here), the
placement plan (GPU / RAM / SSD), SSD streaming, and tree-budget tuning from measured pass times."""
