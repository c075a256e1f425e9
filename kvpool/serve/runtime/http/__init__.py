"""The OpenAI-compatible HTTP front end of ``kvpool serve``."""
