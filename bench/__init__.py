"""Benchmarks that print JSON (`gpufleet bench placement|heartbeat|e2e`): medians and ratios against a baseline measured in the same run."""
