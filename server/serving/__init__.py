"""The protocol-neutral serving pipeline: spec -> prompt -> engine -> text and output pieces."""
