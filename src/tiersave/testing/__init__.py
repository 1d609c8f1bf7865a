"""Public helpers for testing tiersave and third-party storage backends (fault injection, conformance)."""
