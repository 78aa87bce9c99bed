"""Fleet-scale simulation of LinkPass decisions; its benchmark is sim/bench/fleet.py (the
lab's benchmarks, of the testbed and the product, are in bench/).

Import name `linkpass_sim` (not `sim`) so it cannot collide with other packages.
"""
