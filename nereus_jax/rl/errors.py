"""The error the tokenizers and chat templates raise, in its own module: ``rl.tokenizer`` renders through
``rl.chat``, and ``rl.chat`` raises it too, so neither has to import the other for it."""


class TokenizerError(ValueError):
    """A tokenizer, special token, chat template or prompt that cannot be used; the message says what to change."""
