"""specserve load tester: drives any OpenAI-compatible server over HTTP and reports latency,
throughput, goodput and the server's speculation quality (α, τ). `python -m loadtest --help`."""
