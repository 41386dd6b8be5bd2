"""Protocol adapters: each parses its requests into the neutral spec and renders the output."""
