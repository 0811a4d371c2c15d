"""Evaluation: metrics per problem type with bootstrap intervals and the one logits-to-prediction rule (`metrics`),
calibrated probabilities (`calibrate`) and the likely wrong labels among out-of-sample probabilities (`issues`).
May import `core`, `config`, `model`, `data`, `training` and `memory`.
"""
