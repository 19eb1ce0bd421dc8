from diffexp.cli import main

main()
