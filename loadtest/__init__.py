"""specserve loadtest package."""
