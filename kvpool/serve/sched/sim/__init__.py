"""Discrete-event simulation of a disaggregated cluster serving a trace."""
