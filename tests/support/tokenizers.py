"""A tiny word-level HF tokenizer built on the spot (nothing is downloaded)."""

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

TEXTS = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog"]


def build_hf_tokenizer(path, specials=("<pad>", "</s>", "<s>", "<unk>")):
    """Trains a tiny word-level tokenizer on TEXTS and writes it as a tokenizer.json."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=list(specials)))
    tok.save(str(path))
    return path
