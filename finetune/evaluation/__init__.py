"""Evaluation: metrics per problem type with bootstrap intervals and the one logits-to-prediction rule (`metrics`), and
calibrated probabilities (`calibrate`). May import `core`, `config`, `model`, `data`, `training` and `memory`.
"""
