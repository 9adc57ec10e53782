"""k3kit.tokenizer: text <-> token ids for a GGUF model, from the file's own `tokenizer.*` KVs.

gguf_kv   HF `tokenizers` <-> GGUF tokenizer KVs, and the llama.cpp pre-tokenizer regexes
codec     TextCodec (encode, per-token bytes, stop ids, streaming UTF-8 text) and encode()
chat      chat prompts from `tokenizer.chat_template`, rendered sandboxed as transformers does

Layer rule: imports gguf, errors, _io (+ tokenizers, jinja2); never torch. The modules are not
imported here, so `import k3kit.tokenizer.gguf_kv` does not pay for jinja2.
"""
