"""Scale-out backends for the heavy steps of a round (#31): Ray Train workers for the update.

The default backend is in process (:mod:`flow_assets.training.rounds`); nothing here is imported
unless a round asks for it, and ``ray`` comes with the ``ray`` extra.
"""
