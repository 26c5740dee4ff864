"""Text in and out: the tokenizer, chat templates under a budget, prompt files."""
