"""Vision-language datasets: prompts with images (an `images` column of compressed bytes, `<image>` placeholders
in the text). Math-style answers are compared with the last \\boxed{} of the response; DeepEyes' free-form
answers are judged by the LLM judge."""
