"""Fleet-scale simulation of LinkPass decisions; benchmarks live in sim/bench/.

Import name `linkpass_sim` (not `sim`) so it cannot collide with other packages.
"""
