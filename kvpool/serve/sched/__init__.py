"""The torch-free side of serving: router API and routers, the conductor, admission,
cost model, pipeline timing model, planner, replay and the simulator (``sim/``).

Nothing here imports torch or ``kvpool.serve.runtime``."""
