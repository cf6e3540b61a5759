from offload.probe import probe_machine


def test_probe_reports_the_machine() -> None:
    machine = probe_machine()
    assert set(machine) == {"cpu", "cores", "ram_total_gb", "ram_free_gb", "gpus", "platform", "python", "llama_cpp"}
    assert machine["cores"] >= 1
    assert machine["cpu"]
    if machine["ram_total_gb"] is not None and machine["ram_free_gb"] is not None:
        assert 0 < machine["ram_free_gb"] <= machine["ram_total_gb"]
