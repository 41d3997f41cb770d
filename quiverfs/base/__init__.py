"""The base: the error vocabulary, remote storage backends, how commands run and fail, helper
processes, how a server takes its stop signals, and the version. Imports nothing of ours outside
this folder; everything may import it."""
