"""`finetune init`: what a file cannot be (`formats`), the data's shape sniffed from a file or folder (`sniff`), the
training recipe chosen from that shape (`recipe`), and the commented config written and validated (`write`). May
import every other package: `core`, `config`, `model`, `data`, `training`, `memory`, `evaluation` and `deploy`.
"""
