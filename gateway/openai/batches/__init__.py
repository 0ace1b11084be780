"""The Batch API (`/v1/batches`): batches of a file's requests run per tenant in idle capacity,
durably and exactly once (routes, protocol, serving, the runner, a line's run, finalizing)."""
