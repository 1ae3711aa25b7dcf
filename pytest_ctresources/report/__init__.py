"""What a run reports: the summary, the report files, learned needs and where each test ran."""
