"""Scaling laws: model ladders with token budgets, sweeps (local or a Slurm job array), a loss
table collected from the run directories, Chinchilla fits per architecture, plots.

    python -m ttt_lm.scaling ladder FAMILY.yaml [...] (--sizes 125M,350M | --flops 1e18,3e18) --out DIR
    python -m ttt_lm.scaling run DIR [--slurm [slurm/submit.py options]]
    python -m ttt_lm.scaling collect DIR --out losses.csv
    python -m ttt_lm.scaling fit losses.csv --out fit.json [--budget 1e21]
    python -m ttt_lm.scaling plot losses.csv --fit fit.json --out DIR

``ladder.py``: shapes, recipes and budgets; ``sweep.py``: running and collecting; ``fit.py``:
Hoffmann et al.'s approaches 2 and 3; ``plot.py``: the figures.
"""
