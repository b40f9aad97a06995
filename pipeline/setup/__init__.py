"""What a Pipe decides once, when it is built: arguments checked, balance, the ranks' agreement, the cut."""
