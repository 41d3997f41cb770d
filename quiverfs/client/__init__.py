"""The training side: the PyTorch shim (imported as quiverfs.torch), direct reads from the store,
the control channel's caller. May import planning, the filesystem's names and the floors below."""
