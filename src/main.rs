fn main() {
    std::process::exit(troupe::cli::main());
}
