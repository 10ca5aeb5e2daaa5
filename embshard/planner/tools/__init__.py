"""The planner's tools: the command lines (`embshard plan`: cli.py, `embshard calibrate`: calibrate.py), reading
the planner's input from a planner-input YAML or a training config (inputs.py) and the plot of a report (plot.py).
They sit above the planner library (embshard.planner) and the training config (embshard.config); nothing in the
library imports them."""
