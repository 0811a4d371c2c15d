"""The model: where its files come from (`sources`), the precision policy (`precision`: fp32 norms and buffers, fp32
loss, the dtype audit, compile), what a family leaves to the caller (`families`), and the tokenizer and classifier
built from the config (`load`: quantized bases, LoRA, the head's start). May import `core` and `config`.
"""
