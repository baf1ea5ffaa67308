from effkit.cli import main

main()
