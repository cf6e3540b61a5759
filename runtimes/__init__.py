"""What runs a model (llama_cpp, onnx). Runtimes are imported lazily by name, so that nothing heavy
loads until a model does."""
