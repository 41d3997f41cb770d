"""The base: the error vocabulary, remote storage backends, how commands run and fail, helper
processes and the version. Imports nothing of ours outside this folder; everything may import it."""
