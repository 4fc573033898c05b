"""A chat conversation and a chat template for the byte-level tokenizer (which has none), for
the tests of chat data."""

TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sky?"},
        {"role": "assistant", "content": "Blue."}]


def chat_tokenizer():
    from infinity.models import byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer
