"""specserve server package."""
