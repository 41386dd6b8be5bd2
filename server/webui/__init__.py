"""The built-in chat page: static files (``static/``) and the routes that serve them."""
