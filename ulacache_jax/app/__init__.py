"""What users run: the CLI, JSONL request files, model loading, reports and the demo."""
