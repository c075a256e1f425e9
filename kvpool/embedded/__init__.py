"""The embedded pool: master, one node and the client in one process
(``kvpool.Pool.embedded``), with its writer and lease handles and stats."""
