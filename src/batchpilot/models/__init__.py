"""Built-in models behind `model.factory` import paths (users may bring their own torch.nn.Module)."""
