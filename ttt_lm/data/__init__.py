"""Data: raw text (or Hugging Face datasets) -> SentencePiece or Hugging Face tokenizer -> webdataset
token shards -> resumable batches.

Never imports the model: the data path knows token ids, not embeddings.
"""
from ttt_lm.data.config import DataConfig
from ttt_lm.data.loader import (TrainLoader, ValLoader, build_train_loader, build_val_loader,
                                default_total_streams, iter_documents, merge_states)
from ttt_lm.data.manifest import DataError, check_vocab, load_manifest, verify_checksums, vocab_fits
from ttt_lm.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer, open_tokenizer

__all__ = [
    "DataConfig", "DataError", "HFTokenizer", "TrainLoader", "ValLoader", "Tokenizer", "build_train_loader",
    "build_val_loader", "check_vocab", "default_total_streams", "iter_documents", "load_manifest",
    "load_tokenizer", "merge_states", "open_tokenizer", "verify_checksums", "vocab_fits",
]
