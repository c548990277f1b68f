"""`dresd bench`: every method side by side on the same prompts, and the report it writes."""
