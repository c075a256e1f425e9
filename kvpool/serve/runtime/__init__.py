"""The torch side of ``kvpool serve``: model, tokenizer, prefill and decode workers,
pipeline prefill, and the HTTP front end (``http/``)."""
