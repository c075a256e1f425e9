"""The distributed pool: ``kvpool master`` (metadata), ``kvpool node`` (capacity and
bytes), their wire payloads and metrics, and the client (``kvpool.connect``)."""
