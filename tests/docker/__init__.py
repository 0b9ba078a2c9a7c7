"""Docker tests' own files: the test-only compose override and the webhook receiver it runs."""
