from selfdraft.cli import app

app()
