//! Where a passphrase comes from, the same for every Kvasir command: `KVASIR_PASSPHRASE`
//! when set (services, scripts), else a prompt on the terminal; with neither, a clear error
//! rather than a hang. Passphrases are wiped from memory when dropped.

use std::io::IsTerminal;
use std::path::Path;

use kvasir_ledger::Keypair;
use zeroize::Zeroizing;

use crate::{read, KeyFileError, Problem};

/// The environment variable that holds a sealed key file's passphrase.
pub const PASSPHRASE_ENV: &str = "KVASIR_PASSPHRASE";

/// The key in `path`, asking for its passphrase only when it is sealed.
pub fn open(path: &Path) -> Result<Keypair, KeyFileError> {
    match read(path, None) {
        Err(KeyFileError {
            problem: Problem::NeedsPassphrase,
            ..
        }) => {
            let passphrase = ask(&format!("passphrase for {}: ", path.display()))
                .map_err(|problem| KeyFileError::at(path, problem))?;
            read(path, Some(&passphrase))
        }
        other => other,
    }
}

/// A passphrase for sealing a new key file: from the environment, else typed twice.
pub fn new_passphrase() -> Result<Zeroizing<String>, Problem> {
    let first = ask("passphrase for the new key file: ")?;
    let again = ask("the same passphrase again: ")?;
    if first != again {
        return Err(Problem::PassphrasesDiffer);
    }
    if first.is_empty() {
        return Err(Problem::EmptyPassphrase);
    }
    Ok(first)
}

fn ask(prompt: &str) -> Result<Zeroizing<String>, Problem> {
    if let Ok(passphrase) = std::env::var(PASSPHRASE_ENV) {
        return Ok(Zeroizing::new(passphrase));
    }
    if !std::io::stdin().is_terminal() {
        return Err(Problem::NoPassphrase);
    }
    rpassword::prompt_password(prompt)
        .map(Zeroizing::new)
        .map_err(Problem::Prompt)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::write;

    /// The only test that sets the variable: the others never read it.
    #[test]
    fn the_environment_supplies_passphrases() {
        let dir = tempfile::tempdir().unwrap();
        let (sealed, plain) = (dir.path().join("sealed.key"), dir.path().join("plain.key"));
        let keypair = Keypair::from_seed(&[5; 32]);
        write(&sealed, &keypair, Some("from the environment")).unwrap();
        write(&plain, &keypair, None).unwrap();
        std::env::set_var(PASSPHRASE_ENV, "from the environment");
        assert_eq!(open(&sealed).unwrap().address(), keypair.address());
        assert_eq!(open(&plain).unwrap().address(), keypair.address());
        assert_eq!(new_passphrase().unwrap().as_str(), "from the environment");
        std::env::set_var(PASSPHRASE_ENV, "another");
        assert!(matches!(
            open(&sealed),
            Err(KeyFileError {
                problem: Problem::WrongPassphrase,
                ..
            })
        ));
        std::env::set_var(PASSPHRASE_ENV, "");
        assert!(matches!(new_passphrase(), Err(Problem::EmptyPassphrase)));
        std::env::remove_var(PASSPHRASE_ENV);
    }
}
