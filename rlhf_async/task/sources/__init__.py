"""Where a task's rows and prompts come from: the user's files and datasets (`dataset`),
text to token ids for every stage (`tokens`), SFT and preference rows (`user_data`)."""
