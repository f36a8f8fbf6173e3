"""The control plane: resources in the store, the engine fed from its watch, transitions out."""
