"""After a run: final/ written, checked and loaded (`final`), prediction with PyTorch or ONNX (`predict`), a
distilling run's teacher outputs (`teacher`), the Hub model card (`card`), and the ONNX export (`export`). May import
`core`, `config`, `model`, `data`, `training`, `memory` and `evaluation`.
"""
