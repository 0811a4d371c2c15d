"""Memory: measured on a real run (`monitor`), one training window's peak measured by a harness (`peak`), and predicted
before training on fake tensors (`planner`). May import `core`, `config`, `model`, `data` and `training`.
"""
