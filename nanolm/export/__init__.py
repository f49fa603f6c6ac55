"""Getting models out of nanolm, and into it, in other tools' formats.

`nanolm.export.hf` converts to and from HuggingFace `transformers` model
directories (Llama for dense models, Qwen2-MoE for mixture-of-experts ones);
`nanolm.export.gguf` writes GGUF files for llama.cpp and ollama. The optional
library a format needs is imported inside its functions, so importing this
package costs nothing and needs only nanolm's core dependencies.
"""
