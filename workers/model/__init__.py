"""The model: layers and weights (llama.py), finding and converting a model (loader.py), ModelRunner and LocalExecutor (runner.py), the sampler."""
