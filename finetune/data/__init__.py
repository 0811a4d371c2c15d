"""Data from files to batches: raw splits read from any layout (`reading`, the one reader of input files), tokenized
splits and loaders (`build`), the accumulation window every exactness rule rests on (`window`), batches (`collate`)
and packed batches (`packing`). May import `core`, `config` and `model`.
"""
