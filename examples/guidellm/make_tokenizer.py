"""Build a local tokenizer for guidellm without any hub access.

Every token is (at most) 4 bytes of text, the rule TokenFleet's gateway and emulator count
by (control/tokens.py: 4 UTF-8 bytes per token), so guidellm's prompt_tokens=N yields
prompts the gateway counts as N tokens (plus the chat template's few). It is a BPE whose
pre-tokenizer cuts text into 4-character pieces, trained on Faker text (the generator
guidellm's synthetic_text data uses); byte-level, so any text encodes (a piece never seen
in training falls back to shorter tokens).
Usage: python make_tokenizer.py OUT_DIR (run.sh beside it calls it; needs guidellm's packages)
"""

import random
import sys

from faker import Faker
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

out = sys.argv[1]
fake = Faker()
fake.seed_instance(0)
texts = [fake.text(max_nb_chars=2000) for _ in range(2000)]
corpus = [t[shift:] for t in texts for shift in range(4)]  # every 4-char alignment
# guidellm starts each synthetic prompt with a unique "ITER SAMPLE mTURN " (or
# "ITER SAMPLE bBRANCH_TURN ") before the Faker text: learn those pieces too
rng = random.Random(0)
for _ in range(40000):
    tag = rng.choice([f"m{rng.randrange(4)}", f"b{rng.randrange(3)}_{rng.randrange(8)}"])
    sample = rng.randrange(10 ** rng.randint(1, 5))
    corpus.append(f"{rng.randrange(4)} {sample} {tag} " + fake.text(max_nb_chars=200)[:40])

tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
        pre_tokenizers.Split(Regex(r"[\s\S]{1,4}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=60000,
    min_frequency=1,
    show_progress=False,
    special_tokens=["<s>", "</s>", "<pad>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
)
tok.train_from_iterator(corpus, trainer=trainer)
fast = PreTrainedTokenizerFast(
    tokenizer_object=tok,
    bos_token="<s>",
    eos_token="</s>",
    pad_token="<pad>",
    model_max_length=131072,
)
fast.save_pretrained(out)

# check: loads with AutoTokenizer, round-trips, about 4 bytes a token on fresh Faker text
t = AutoTokenizer.from_pretrained(out)
fake.seed_instance(12345)
sample = "0 17 m0 " + fake.text(max_nb_chars=5000)
ids = t.encode(sample)
assert t.decode(ids) == sample
print(f"saved {out}: vocab {t.vocab_size}, {len(sample.encode()) / len(ids):.3f} bytes/token")
