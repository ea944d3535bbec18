"""The fork's own llama3 (shadows the library's for a plain ``ConfigManager()``)."""
