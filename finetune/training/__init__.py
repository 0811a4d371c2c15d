"""The step and the run around it: optimizers and schedules (`optim`), the Accelerator, signals and progress
(`runtime`), experiment trackers (`trackers`), one rank's failure ending every rank (`ranks`), the wall-time budget
(`budget`), atomic checkpoints and the run's progress schema (`checkpoint`), and what happens past one machine
(`nodes`: shared storage, lost ranks and nodes). May import `core`, `config`, `model` and `data`.
"""
